"""Markdown code fences for upstream text, which may hold backtick runs of any length."""

import re


def fence_for(text: str) -> str:
    """A backtick fence longer than any backtick run inside the text, so no excerpt can close it early."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    return "`" * max(3, longest + 1)
