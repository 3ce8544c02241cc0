"""Long excerpts fold: the page shows the highlighted lines with a few lines of context, and the whole
citation one click away, both numbered with the upstream line numbers.

Both views are cut from the same verified Excerpt text (pin_and_cite.site.render), so folding changes what is
shown first, never what is cited. The folded view is a fenced block of its own window; the whole excerpt is in
a <details> after it; notes.css hides the folded view while the whole one is open.
"""

from __future__ import annotations

FOLD_OVER = 16  # an excerpt of more lines than this folds
CONTEXT = 3  # lines shown on each side of the highlighted ones (or the first 3 * CONTEXT + 1 without)
MIN_HIDDEN = 4  # folding that would hide fewer lines than this is not worth a click


def fold_window(lines: list[str], first: int, highlight: tuple[int, int] | None) -> tuple[int, int] | None:
    """The upstream line range the folded view shows, or None when the excerpt is shown whole. The window
    never starts or ends on a blank line (Pygments would drop it and shift every line number)."""
    last = first + len(lines) - 1
    if len(lines) <= FOLD_OVER:
        return None
    a, b = highlight or (first, first)
    top, bottom = max(first, a - CONTEXT), min(last, (b if highlight else first + 2 * CONTEXT) + CONTEXT)
    while top < a and not lines[top - first].strip():
        top += 1
    while bottom > b and not lines[bottom - first].strip():
        bottom -= 1
    return (top, bottom) if len(lines) - (bottom - top + 1) >= MIN_HIDDEN else None


def folded_markdown(window_block: str, whole_block: str, lines: tuple[int, int]) -> str:
    """The folded view, then the whole excerpt collapsed under a summary naming its range (md_in_html)."""
    first, last = lines
    return (
        f'<div class="excerpt-fold" markdown="1">\n<div class="excerpt-folded" markdown="1">\n\n{window_block}\n'
        f'</div>\n<details class="excerpt-whole" markdown="1">\n<summary>Show all {last - first + 1} lines, '
        f"L{first}–L{last}</summary>\n\n{whole_block}\n</details>\n</div>\n"
    )
