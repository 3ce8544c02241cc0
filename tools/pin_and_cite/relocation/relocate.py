"""The relocation engine: where does a citation made at one commit point at another? Pure functions of text.

Statuses: `unchanged` (same lines, same text), `moved` (same text at other lines), `changed` (the code is still
there but its text differs, or which identical copy is meant is unclear: review it), `deleted` (no
counterpart), `error` (the citation cannot be answered; `reason` says why). Text is compared line by line
ignoring trailing whitespace. The rule everything else serves: `unchanged`/`moved` is only ever answered when
the text at the answered lines is exactly the cited text; when in doubt the answer is `changed`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from pin_and_cite.core import symbols
from pin_and_cite.core.errors import PinAndCiteError
from pin_and_cite.relocation.textmatch import (
    LineIndex,
    LineMap,
    Span,
    aligned_span,
    best_windows,
    most_similar,
    normalized,
    retained,
    similarity,
)

MIN_SIMILARITY = 0.5  # a counterpart keeps at least this share of the cited text, else: deleted
MIN_IN_PLACE = 0.3  # ... or this share, where the diff aligns it in place (rewritten, not gone)
RENAMED_SIMILARITY = 0.6  # a definition under a new name must be at least this like the old one
# The diff, line index and fuzzy windows of a file take about 40 bytes of memory per byte (a 19 MB file once
# took 4.5 GB with its parse, which symbols.MAX_PARSED_CHARS now bounds): 8 MiB is 300 MB, 50 times the
# largest file cited.
MAX_RELOCATED_CHARS = 8 << 20
MAX_GROWTH = 3  # an edited range may grow to 3x its length (+50 lines) and still be one pointer


@dataclass(frozen=True)
class Relocation:
    status: str  # unchanged | moved | changed | deleted | error
    lines: tuple[int, int] | None  # 1-based inclusive, at the new commit
    reason: str | None = None  # for errors: why; for some `changed` answers: what to review
    path: str | None = None  # the file `lines` are in, when not the cited one (relocation.crossfile)
    symbol: str | None = None  # the definition's qualified name there, when not the cited one

    def as_json(self, cite: str, cited_path: str | None = None) -> dict:
        out = {
            "cite": cite,
            "status": self.status,
            "lines": list(self.lines) if self.lines else None,
            "path": (self.path or cited_path) if self.lines else None,
        }
        if self.symbol:
            out["symbol"] = self.symbol
        if self.reason:
            out["reason"] = self.reason
        return out


def _found(span: Span, status: str, reason: str | None = None) -> Relocation:
    return Relocation(status, (span[0] + 1, span[1]), reason)


class FilePair:
    """One file at two commits, with the per-file work (diff, line index, symbol tables) done once and
    shared by every citation of that file."""

    def __init__(
        self, path: str, old: Sequence[str], new: Sequence[str], old_label: str = "old", new_label: str = "new"
    ):
        self.path, self.old_label, self.new_label = path, old_label, new_label
        for label, lines in ((old_label, old), (new_label, new)):
            if sum(map(len, lines)) > MAX_RELOCATED_CHARS:
                raise PinAndCiteError(
                    f"{path} at {label} is over {MAX_RELOCATED_CHARS >> 20} MiB, more than relocate compares "
                    f"line by line; cite a smaller file"
                )
        self.old_raw, self.new_raw = old, new
        self.old, self.new = normalized(old), normalized(new)

    @functools.cached_property
    def index(self) -> LineIndex:
        return LineIndex(self.new)

    @functools.cached_property
    def diff(self) -> LineMap:
        return LineMap(self.old, self.new)

    def definitions(self, which: str) -> dict[str, list[tuple[int, int]]]:
        """Qualified name -> spans at `which` ("old"/"new"); raises PinAndCiteError when not Python."""
        return self._definitions_old if which == "old" else self._definitions_new

    @functools.cached_property
    def _definitions_old(self):
        return self._parse(self.old_raw, self.old_label)

    @functools.cached_property
    def _definitions_new(self):
        return self._parse(self.new_raw, self.new_label)

    def _parse(self, lines: Sequence[str], label: str):
        if not self.path.endswith(symbols.PYTHON_SUFFIXES):
            raise PinAndCiteError(f"{self.path} is not a Python file; cite it by line range")
        text = "\n".join(lines) + "\n"
        if len(text) > symbols.MAX_PARSED_CHARS:  # refused before it is parsed, with its own reason
            return symbols.definitions(text, f"{self.path} at {label}")
        try:
            return symbols.definitions(text, self.path)
        except PinAndCiteError:
            raise PinAndCiteError(f"{self.path} is not valid Python at {label}; cite it by line range") from None

    def _hint_definitions(self, which: str) -> dict[str, list[tuple[int, int]]]:
        """Definitions for use as a hint only (ranges work on any text file): empty when not parsable."""
        try:
            return self.definitions(which)
        except PinAndCiteError:
            return {}

    def enclosing(self, which: str, span: Span) -> str | None:
        """The innermost uniquely defined name whose definition contains the 0-based `span`."""
        unique = {name: spans for name, spans in self._hint_definitions(which).items() if len(spans) == 1}
        return symbols.enclosing(unique, (span[0] + 1, span[1]))

    def counterpart_region(self, span: Span) -> Span | None:
        """The new span of the definition enclosing `span` at the old commit, if it still exists once."""
        name = self.enclosing("old", span)
        spans = self._hint_definitions("new").get(name or "", [])
        return (spans[0][0] - 1, spans[0][1]) if len(spans) == 1 else None

    # -- line ranges ----------------------------------------------------------------------------------

    def relocate_range(self, start: int, end: int) -> Relocation:
        if end > len(self.old):
            return Relocation(
                "error",
                None,
                f"L{start}-L{end} is past the end of {self.path} at {self.old_label} ({len(self.old)} lines)",
            )
        span = (start - 1, end)
        block = self.old[span[0] : span[1]]
        copies = self.index.find(block)
        if not copies:
            return self._edited(span, block)
        chosen = self._which_copy(span, copies)
        if chosen is None:
            near = min(copies, key=lambda s: abs(s - self.diff.predicted_start(span)))
            return _found(
                (near, near + len(block)),
                "changed",
                f"{len(copies)} identical copies at the new commit; check this is the one meant",
            )
        return _found((chosen, chosen + len(block)), "unchanged" if chosen == span[0] else "moved")

    def _which_copy(self, span: Span, copies: list[int]) -> int | None:
        """The copy that is the cited text itself: the only one, the one the diff aligns the block with, or
        the only one inside the same enclosing definition; None when that stays unclear."""
        if len(copies) == 1:
            return copies[0]
        votes = sorted(((self.diff.agreement(span, s), s) for s in copies), reverse=True)
        if votes[0][0] * 2 > span[1] - span[0] and votes[0][0] > votes[1][0]:
            return votes[0][1]
        name = self.enclosing("old", span)
        if name is not None:
            inside = [s for s in copies if self.enclosing("new", (s, s + span[1] - span[0])) == name]
            if len(inside) == 1:
                return inside[0]
        return None

    def _edited(self, span: Span, block: list[str]) -> Relocation:
        """No exact copy is left. Trust the diff's alignment when it keeps the range inside the same
        definition, or keeps a good part of the cited text (rewritten in place); otherwise look for the most
        similar window inside the enclosing definition, then anywhere (the code may have moved and changed), and
        call it changed when at least half the cited text survives there. Else deleted."""
        hull = self.diff.hull(span)
        if hull is not None and hull[1] - hull[0] > MAX_GROWTH * len(block) + 50:
            hull = None  # aligned across a huge insertion: not a pointer
        region = self.counterpart_region(span)
        if hull is not None and (
            self.diff.kept_share(span, block) >= MIN_IN_PLACE
            or _inside(hull, region)
            or retained(block, self.new[hull[0] : hull[1]]) >= MIN_IN_PLACE
        ):
            return _found(hull, "changed")
        candidates = [hull] if hull else []
        for where in ([region] if region else []) + [(0, len(self.new))]:
            candidates += [aligned_span(block, self.new, w) for w in best_windows(block, self.new, where)]
        best = most_similar(block, [self.new[a:b] for a, b in candidates])
        if best is not None and retained(block, self.new[slice(*candidates[best])]) >= MIN_SIMILARITY:
            return _found(candidates[best], "changed")
        return Relocation("deleted", None)

    # -- symbols --------------------------------------------------------------------------------------

    def relocate_symbol(self, name: str) -> Relocation:
        try:
            old_span = symbols.resolve(self.definitions("old"), name, f"{self.path} at {self.old_label}")
            new_defs = self.definitions("new")
        except PinAndCiteError as exc:
            return Relocation("error", None, str(exc))
        old_text = self.old[old_span[0] - 1 : old_span[1]]
        spans = new_defs.get(name, [])
        if len(spans) == 1:
            ((a, b),) = spans
            if self.new[a - 1 : b] == old_text:
                return Relocation("unchanged" if (a, b) == old_span else "moved", (a, b))
            return Relocation("changed", (a, b))
        if spans:
            best = max(spans, key=lambda s: similarity(old_text, self.new[s[0] - 1 : s[1]]))
            return Relocation("changed", best, f"{name} is defined {len(spans)} times at {self.new_label}")
        return self._renamed(name, old_text)

    def _renamed(self, name: str, old_text: list[str]) -> Relocation:
        """A name that is gone: the most similar definition of the same kind under a name that is new."""
        old_defs, new_defs = self.definitions("old"), self.definitions("new")
        kind = definition_kind(old_text)
        candidates = [
            (new_name, spans[0])
            for new_name, spans in new_defs.items()
            if new_name not in old_defs
            and len(spans) == 1
            and definition_kind(self.new[spans[0][0] - 1 : spans[0][1]]) == kind
        ]
        scored = [
            (similarity(old_text, self.new[a - 1 : b], RENAMED_SIMILARITY), new_name, (a, b))
            for new_name, (a, b) in candidates
        ]
        scored = [s for s in scored if s[0] >= RENAMED_SIMILARITY]
        if not scored:
            return Relocation("deleted", None)
        _, new_name, span = max(scored)
        return Relocation("changed", span, f"{name} is gone; {new_name} looks like it renamed")


def _inside(span: Span, region: Span | None) -> bool:
    return region is not None and region[0] <= span[0] and span[1] <= region[1]


def definition_kind(lines: Sequence[str]) -> str:
    """'class' or 'def': the keyword of a definition's first line that opens one (decorators come before)."""
    for line in lines:
        words = line.split()
        if words[:1] == ["class"]:
            return "class"
        if words[:1] == ["def"] or words[:2] == ["async", "def"]:
            return "def"
    return "def"


def relocate(path: str, old: Sequence[str], new: Sequence[str], cite: tuple[int, int] | str) -> Relocation:
    """One citation (a 1-based inclusive line range or a qualified name) of `path`, from `old` to `new` lines."""
    pair = FilePair(path, old, new)
    return pair.relocate_symbol(cite) if isinstance(cite, str) else pair.relocate_range(*cite)
