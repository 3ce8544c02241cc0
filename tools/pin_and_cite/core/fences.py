"""Markdown code fences and spans for upstream text, which may hold backtick runs of any length."""

import re


def _longest_run(text: str) -> int:
    return max((len(run) for run in re.findall(r"`+", text)), default=0)


def fence_for(text: str) -> str:
    """A backtick fence longer than any backtick run inside the text, so no excerpt can close it early."""
    return "`" * max(3, _longest_run(text) + 1)


def code_span(text: str) -> str:
    """`text` (a parameter default as upstream writes it) as one inline code span on one line, fenced the same
    way: a backtick in it must not end the span, or what follows (`<script>`) is live HTML on the page."""
    text = " ".join(text.split())
    fence = "`" * (_longest_run(text) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"
