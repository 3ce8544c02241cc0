"""What `bump` makes of one citation (Carried) and of each highlight written on it (CarriedHighlight): the
records pin_and_cite.relocation.bump and pin_and_cite.relocation.bump_highlights both read and write, kept
apart so that neither module imports the other back."""

from __future__ import annotations

from dataclasses import dataclass, field

from pin_and_cite.core.citation import Spec
from pin_and_cite.core.highlights import Lines, format_like
from pin_and_cite.core.notes import Written
from pin_and_cite.relocation.relocate import Relocation

EXACT = ("unchanged", "moved")  # the statuses whose text is the same: lines keep their offsets


@dataclass(frozen=True)
class CarriedHighlight:
    place: Written  # the cite() call whose highlight= this is
    status: str  # of the highlighted lines: unchanged | moved | changed | deleted | error | left
    new: Lines | None  # what the template says now; None: left as written
    review: str | None = None  # why a person should look; None: carried exactly

    @property
    def literal(self) -> str | None:
        """The new highlight= literal, or None when the template keeps its own."""
        return format_like(self.place.highlight, self.new) if self.new else None

    def as_json(self, root) -> dict:
        return {
            "where": self.place.where(root),
            "cite": self.place.argument,
            "highlight": self.place.highlight,
            "status": self.status,
            "new_highlight": self.literal or self.place.highlight,
            "review": self.review,
        }


@dataclass
class Carried:
    """One citation of the bumped source: where it is written, what the engine answered, what it becomes."""

    spec: Spec
    places: list[Written]
    in_lock: bool
    answer: Relocation | None = None
    new_spec: Spec | None = None  # None: left as written (deleted, renamed symbol): needs a person
    old_lines: tuple[int, int] = (0, 0)
    old_text: list[str] = field(default_factory=list)
    new_text: list[str] = field(default_factory=list)
    highlights: list[CarriedHighlight] = field(default_factory=list)
