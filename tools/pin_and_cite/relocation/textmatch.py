"""Line-level text matching for relocation: exact block search, line-by-line diff maps, fuzzy windows.

Every comparison works on *normalized* lines (trailing whitespace, including a CR, stripped), so a file
that only switched to CRLF or lost trailing spaces still matches exactly. Fuzzy scores compare tokens, so
indentation and spacing do not count: code that moved into a class or out of a block still scores as similar.
"""

from __future__ import annotations

import difflib
import re
from collections import defaultdict
from collections.abc import Sequence

Span = tuple[int, int]  # 0-based, end exclusive, over lines


def normalized(lines: Sequence[str]) -> list[str]:
    return [line.rstrip() for line in lines]


_TOKEN = re.compile(r"\w+|[^\w\s]")


def _tokens(lines: Sequence[str]) -> list[str]:
    """Words and punctuation: comparing these (not characters) is fast, and blind to indentation and spacing."""
    return _TOKEN.findall("\n".join(lines))


def similarity(a: Sequence[str], b: Sequence[str], at_least: float = 0.0) -> float:
    """0..1 likeness of two line blocks by tokens (0.0 early when the lengths alone rule out `at_least`)."""
    left, right = _tokens(a), _tokens(b)
    if not left and not right:
        return 1.0
    if 2 * min(len(left), len(right)) < at_least * (len(left) + len(right)):
        return 0.0
    return difflib.SequenceMatcher(None, left, right, autojunk=False).ratio()


def retained(a: Sequence[str], b: Sequence[str]) -> float:
    """The share of block `a`'s tokens still found, in order, in `b`."""
    left, right = _tokens(a), _tokens(b)
    if not left:
        return 1.0
    matcher = difflib.SequenceMatcher(None, left, right, autojunk=False)
    return sum(m.size for m in matcher.get_matching_blocks()) / len(left)


def most_similar(block: Sequence[str], candidates: list[Sequence[str]]) -> int | None:
    """Index of the candidate sharing the most of `block`'s non-blank lines, in order, indentation aside
    (the first on ties; None when there is no candidate). Lines, not tokens: this only ranks candidates
    (cheaply, and the block is indexed once); `retained` then judges the winner by tokens."""
    matcher = difflib.SequenceMatcher(None, autojunk=False)
    matcher.set_seq2(_content(block))
    best, best_score = None, -1.0
    for k, candidate in enumerate(candidates):
        matcher.set_seq1(_content(candidate))
        if matcher.real_quick_ratio() > best_score and matcher.quick_ratio() > best_score:
            score = matcher.ratio()
            if score > best_score:
                best, best_score = k, score
    return best


def _content(lines: Sequence[str]) -> list[str]:
    return [line.strip() for line in lines if line.strip()]


class LineIndex:
    """Where each normalized line occurs in a file, to find a block's exact copies without scanning."""

    def __init__(self, lines: Sequence[str]):
        self.lines = lines
        self.positions: dict[str, list[int]] = defaultdict(list)
        for i, line in enumerate(lines):
            self.positions[line].append(i)

    def find(self, block: Sequence[str]) -> list[int]:
        """Start offsets of every exact copy of `block` (anchored on its rarest line)."""
        if not block:
            return []
        offset = min(range(len(block)), key=lambda i: len(self.positions.get(block[i], ())))
        starts = (p - offset for p in self.positions.get(block[offset], ()))
        n = len(block)
        return [s for s in starts if s >= 0 and list(self.lines[s : s + n]) == list(block)]


class LineMap:
    """The diff between two versions of a file as a per-line map old -> new.

    `equal[i]` is the new line that old line i is identical to in the alignment (or -1); `near[i]` also maps
    lines the diff marks as replaced, proportionally within their hunk (-1 only for lines deleted outright).
    """

    def __init__(self, old: Sequence[str], new: Sequence[str]):
        self.equal = [-1] * len(old)
        self.near = [-1] * len(old)
        matcher = difflib.SequenceMatcher(None, old, new, autojunk=False)
        for tag, i1, i2, j1, j2 in matcher.get_opcodes():
            if tag == "equal":
                self.equal[i1:i2] = self.near[i1:i2] = range(j1, j2)
            elif tag == "replace":
                for i in range(i1, i2):
                    self.near[i] = j1 + (i - i1) * (j2 - j1) // (i2 - i1)
                self.near[i2 - 1] = j2 - 1

    def hull(self, span: Span) -> Span | None:
        """The new lines that the old lines of `span` align with (None if all of them were deleted)."""
        mapped = [j for j in self.near[span[0] : span[1]] if j >= 0]
        return (min(mapped), max(mapped) + 1) if mapped else None

    def kept_share(self, span: Span, block: Sequence[str]) -> float:
        """The share of the block's tokens on lines the diff keeps identical (a cheap lower bound of
        `retained` over the hull, enough to accept most lightly edited ranges without a token diff)."""
        counts = [len(_TOKEN.findall(line)) for line in block]
        total = sum(counts)
        kept = sum(c for c, i in zip(counts, range(*span)) if self.equal[i] >= 0)
        return kept / total if total else 1.0

    def agreement(self, span: Span, new_start: int) -> int:
        """How many lines of `span` the diff aligns with the same lines of a copy starting at `new_start`."""
        return sum(1 for k, i in enumerate(range(*span)) if self.equal[i] == new_start + k)

    def predicted_start(self, span: Span) -> int:
        """Where the diff expects `span` to start in the new file, from the nearest aligned line."""
        for distance in range(len(self.near)):
            for i in (span[0] - distance, span[0] + distance):
                if 0 <= i < len(self.near) and self.near[i] >= 0:
                    return max(0, self.near[i] - (i - span[0]))
        return span[0]


def best_windows(block: Sequence[str], new: Sequence[str], region: Span, count: int = 3) -> list[Span]:
    """The `count` windows of len(block) lines inside `region` holding the most lines that also occur in
    `block` (indentation ignored, blank lines not counted); windows holding none are not candidates."""
    wanted = {line.strip() for line in block if line.strip()}
    n = len(block)
    lo, hi = region
    if hi <= lo:
        return []
    hits = [1 if new[j].strip() in wanted else 0 for j in range(lo, hi)]
    scored, running = [], sum(hits[:n])
    for start in range(lo, max(lo + 1, hi - n + 1)):
        if running:
            scored.append((-running, start))
        k = start - lo
        running += (hits[k + n] if k + n < len(hits) else 0) - hits[k]
    scored.sort()
    return [(start, min(start + n, hi)) for _, start in scored[:count]]


def aligned_span(block: Sequence[str], new: Sequence[str], window: Span) -> Span:
    """Refine a rough window to the new lines that actually align with `block`: diff the block against the
    window widened by its own length on both sides, take the matched lines' hull, and stretch it over
    the block's unmatched first and last lines (they were edited, not dropped)."""
    n = len(block)
    lo, hi = max(0, window[0] - n), min(len(new), window[1] + n)
    stripped = [line.strip() for line in new[lo:hi]]
    matcher = difflib.SequenceMatcher(None, [line.strip() for line in block], stripped, autojunk=False)
    matched = [
        m for m in matcher.get_matching_blocks() if m.size and any(block[m.a + k].strip() for k in range(m.size))
    ]
    if not matched:
        return window
    first, last = matched[0], matched[-1]
    start = lo + first.b - first.a
    end = lo + last.b + last.size + (n - last.a - last.size)
    return max(lo, start), min(hi, end)
