"""What `bump` does with the highlights of a citation: each moves with it, and lands on whole statements inside it.

A highlight belongs to one cite() call (`highlight="Lx-Ly"`, absolute upstream lines), so each call is carried
on its own. Where the citation's text moved unchanged, a highlight inside it keeps its offset (same text, same
lines: exact). Otherwise the highlighted lines are relocated like a range citation, with the same engine.
The answer is written without review only when the highlighted text is the same, lies inside the citation's
new lines, and is still whole statements there (pin_and_cite.core.highlights). Anything else is reported for review:
where something of the highlight is left inside the citation, the template gets the nearest whole statements
holding it (a best guess, said so); where nothing is (deleted, moved out of the citation, or its citation is
left as written), the highlight is left as written, so `check` fails on it if it no longer fits.
"""

from __future__ import annotations

from pin_and_cite.core.errors import PinAndCiteError
from pin_and_cite.core.highlights import Lines, Statements, best_guess, parse_highlight
from pin_and_cite.core.notes import Written
from pin_and_cite.core.resolve import Resolver
from pin_and_cite.relocation.carried import EXACT, Carried, CarriedHighlight
from pin_and_cite.relocation.relocate import FilePair


def carry(c: Carried, pair: FilePair | None, resolver: Resolver) -> list[CarriedHighlight]:
    """The carried highlight of every place that writes one for citation `c` (already carried by bump);
    a malformed highlight is an error naming its template line. `pair` is the cited file at both commits,
    None when the citation's code went into another file (then only an exact move can carry a highlight)."""
    places = [place for place in c.places if place.highlight]
    if not places:
        return []
    olds = []
    for place in places:
        try:
            olds.append(parse_highlight(place.highlight))
        except PinAndCiteError as exc:
            raise PinAndCiteError(f"{place.where(resolver.project.root)}: {exc}") from None
    new_cited, statements = None, None
    if c.new_spec is not None:
        excerpt, _ = resolver.resolve(c.new_spec)
        new_cited, statements = excerpt.lines, resolver.statements_in(excerpt)
    return [_carry_one(place, old, c, pair, new_cited, statements) for place, old in zip(places, olds)]


def _carry_one(
    place: Written,
    old: Lines,
    c: Carried,
    pair: FilePair | None,
    new_cited: Lines | None,
    statements: Statements | None,
) -> CarriedHighlight:
    if new_cited is None:
        return CarriedHighlight(place, "left", None, "left as written with its citation")
    if c.answer.status in EXACT and c.old_lines[0] <= old[0] and old[1] <= c.old_lines[1]:
        shift = new_cited[0] - c.old_lines[0]
        status, lines, reason = ("moved" if shift else "unchanged"), (old[0] + shift, old[1] + shift), None
    elif pair is None:
        return CarriedHighlight(
            place, "left", None, "its citation's code went into another file and changed; left as written"
        )
    else:
        answer = pair.relocate_range(*old)
        status, lines, reason = answer.status, answer.lines, answer.reason
    inside = lines is not None and new_cited[0] <= lines[0] and lines[1] <= new_cited[1]
    problem = statements.problem(lines) if statements and inside else None
    if status in EXACT and inside and problem is None:
        return CarriedHighlight(place, status, lines)
    why = _why(status, reason, problem)
    guess = best_guess(lines, new_cited, statements) if lines else None
    if guess is None:
        return CarriedHighlight(place, status, None, f"{why}; left as written")
    return CarriedHighlight(place, status, guess, f"{why}; set to the nearest whole statements inside the citation")


def _why(status: str, reason: str | None, problem: str | None) -> str:
    """What a person reviewing a highlight should know about its lines."""
    if status in EXACT:
        return (
            f"the highlighted lines are not whole statements at the new commit: {problem}"
            if problem
            else "the highlighted code moved out of the citation's new lines"
        )
    if status == "deleted":
        return "the highlighted code has no counterpart"
    if status == "error":
        return f"the highlighted lines cannot be relocated: {reason}"
    return f"the highlighted code changed{f' ({reason})' if reason else ''}"
